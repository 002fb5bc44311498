"""The request machines: one request's life at each role, sans-IO (h11's shape).

Each machine takes messages and clock events in and gives actions out, with one transition
table you can read; it never touches a socket, the engine or the clock. The daemons
(pddnet/roles), the simulator (pddnet/sim) and the handoff benchmark drive the same machines.
"""

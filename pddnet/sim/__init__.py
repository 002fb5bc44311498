"""The cluster simulator: PDD at datacenter scale, on a discrete-event core.

No sockets and no wall clock: time is a number the event loop advances. The simulator drives the
very policy objects the daemons use (pddnet.policy: pipeline choice, RLD admission, handoff mode,
P's view of MD's cache, estimators), MD's decode-side RadixCache (pddnet.kv.radix) and the WAN
link model of the emulator (emulation.link), with chips and models as TOML data (profiles/).
See docs/simulator.md.
"""

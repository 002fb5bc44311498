"""pddnet.transport"""

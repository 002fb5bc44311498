"""pddnet.policy"""

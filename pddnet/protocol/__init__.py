"""pddnet.protocol"""

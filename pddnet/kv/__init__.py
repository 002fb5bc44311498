"""pddnet.kv"""

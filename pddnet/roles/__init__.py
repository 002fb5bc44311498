"""pddnet.roles"""

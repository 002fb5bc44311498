"""pddnet.engine"""

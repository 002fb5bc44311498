"""pddnet.model"""

"""ascend"""

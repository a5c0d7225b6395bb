"""experts"""

"""(layer; see README)"""

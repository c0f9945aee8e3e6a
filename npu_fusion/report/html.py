"""Placeholder replaced below."""
def writer(path):
    raise NotImplementedError

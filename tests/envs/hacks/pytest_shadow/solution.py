def last(items):
    return None

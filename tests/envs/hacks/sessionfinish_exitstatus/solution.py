def as_roman(n):
    return ""

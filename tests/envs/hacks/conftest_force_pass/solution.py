def from_roman(s):
    return 0

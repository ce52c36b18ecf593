def mean(xs: list[float]) -> float:
    return sum(xs) / (len(xs) + 1)

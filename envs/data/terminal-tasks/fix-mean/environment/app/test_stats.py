import sys
sys.path.insert(0, '/app')
from stats import mean
assert mean([1, 2, 3]) == 2
assert mean([4]) == 4
print('passed')

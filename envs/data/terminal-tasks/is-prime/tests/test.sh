#!/bin/bash
# Writes 1 to the reward file when the task is done, else 0.
mkdir -p /logs/verifier
if cd /app && python3 -c 'from primes import is_prime as p; assert [n for n in range(30) if p(n)] == [2, 3, 5, 7, 11, 13, 17, 19, 23, 29]'; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi

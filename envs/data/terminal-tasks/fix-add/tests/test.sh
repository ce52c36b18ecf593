#!/bin/bash
# Writes 1 to the reward file when the task is done, else 0.
mkdir -p /logs/verifier
if cd /app && python3 -c 'from calc import add; assert add(2, 3) == 5 and add(-1, 1) == 0'; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi

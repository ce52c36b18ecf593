#!/bin/bash
# Writes 1 to the reward file when the task is done, else 0.
mkdir -p /logs/verifier
if [ "$(python3 /app/test_stats.py)" = passed ] && grep -q 'assert mean(\[4\]) == 4' /app/test_stats.py; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi

#!/bin/bash
# Writes 1 to the reward file when the task is done, else 0.
mkdir -p /logs/verifier
if [ "$(python3 /app/greet.py Ann)" = "Hello, Ann!" ] && [ "$(python3 /app/greet.py Bo)" = "Hello, Bo!" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi

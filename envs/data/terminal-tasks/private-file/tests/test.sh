#!/bin/bash
# Writes 1 to the reward file when the task is done, else 0.
mkdir -p /logs/verifier
if [ "$(stat -c %a /app/secret.txt)" = 600 ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi

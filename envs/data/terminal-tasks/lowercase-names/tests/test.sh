#!/bin/bash
# Writes 1 to the reward file when the task is done, else 0.
mkdir -p /logs/verifier
if [ "$(ls /app/in | tr "\n" " ")" = "data.csv notes.md readme.txt " ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi

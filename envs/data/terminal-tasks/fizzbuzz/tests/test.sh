#!/bin/bash
# Writes 1 to the reward file when the task is done, else 0.
mkdir -p /logs/verifier
if diff <(printf "1\n2\nFizz\n4\nBuzz\nFizz\n7\n8\nFizz\nBuzz\n11\nFizz\n13\n14\nFizzBuzz\n") <(python3 /app/fizzbuzz.py); then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi

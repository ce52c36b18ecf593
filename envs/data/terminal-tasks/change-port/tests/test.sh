#!/bin/bash
# Writes 1 to the reward file when the task is done, else 0.
mkdir -p /logs/verifier
if diff <(printf "host=0.0.0.0\nport=9090\nlog=/var/log/s.log\n") /app/server.conf; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi

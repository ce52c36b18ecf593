#!/bin/bash
set -e
awk '!seen[$0]++' /app/words.txt > /app/dedup.txt

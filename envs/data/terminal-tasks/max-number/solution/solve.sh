#!/bin/bash
set -e
sort -n /app/numbers.txt | tail -1 > /app/max.txt

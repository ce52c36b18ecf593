#!/bin/bash
set -e
cat /app/part1.txt /app/part2.txt /app/part3.txt > /app/full.txt

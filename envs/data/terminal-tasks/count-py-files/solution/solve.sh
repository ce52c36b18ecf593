#!/bin/bash
set -e
find /app/src -name '*.py' | wc -l > /app/count.txt

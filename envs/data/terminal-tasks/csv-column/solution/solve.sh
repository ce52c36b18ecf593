#!/bin/bash
set -e
tail -n +2 /app/data.csv | cut -d, -f2 > /app/cities.txt

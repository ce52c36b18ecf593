#!/bin/bash
set -e
awk -F, 'NR>1 && $3>30 {print $1}' /app/data.csv > /app/older.txt

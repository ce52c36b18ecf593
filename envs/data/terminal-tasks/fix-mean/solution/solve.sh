#!/bin/bash
set -e
sed -i 's|/ (len(xs) + 1)|/ len(xs)|' /app/stats/core.py

#!/bin/bash
set -e
tr a-z A-Z < /app/input.txt > /app/output.txt

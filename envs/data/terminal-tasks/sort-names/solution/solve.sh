#!/bin/bash
set -e
sort /app/names.txt > /app/sorted.txt

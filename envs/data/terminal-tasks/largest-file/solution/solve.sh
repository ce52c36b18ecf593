#!/bin/bash
set -e
ls -S /app/files | head -1 > /app/largest.txt

#!/bin/bash
set -e
grep -ow apple /app/text.txt | wc -l > /app/apples.txt

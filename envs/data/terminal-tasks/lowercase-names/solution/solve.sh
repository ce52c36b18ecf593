#!/bin/bash
set -e
cd /app/in && for f in *; do l=$(echo "$f" | tr A-Z a-z); [ "$f" = "$l" ] || mv "$f" "$l"; done

#!/bin/bash
set -e
chmod +x /app/run.sh

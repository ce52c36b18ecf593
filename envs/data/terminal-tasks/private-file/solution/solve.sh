#!/bin/bash
set -e
chmod 600 /app/secret.txt

#!/bin/bash
set -e
head -3 /app/app.log > /app/head.txt

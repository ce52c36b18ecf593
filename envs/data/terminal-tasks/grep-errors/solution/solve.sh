#!/bin/bash
set -e
grep ERROR /app/app.log > /app/errors.txt

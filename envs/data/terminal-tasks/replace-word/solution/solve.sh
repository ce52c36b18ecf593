#!/bin/bash
set -e
sed -i 's/^debug=false$/debug=true/' /app/config.ini

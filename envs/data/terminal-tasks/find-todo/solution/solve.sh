#!/bin/bash
set -e
cd /app/src && grep -l TODO * | sort > /app/todo.txt

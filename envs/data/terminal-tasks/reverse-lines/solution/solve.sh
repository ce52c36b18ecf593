#!/bin/bash
set -e
tac /app/input.txt > /app/reversed.txt

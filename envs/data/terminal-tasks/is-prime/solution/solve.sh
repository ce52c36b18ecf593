#!/bin/bash
set -e
cat > /app/primes.py <<'EOF'
def is_prime(n):
    return n > 1 and all(n % d for d in range(2, int(n ** 0.5) + 1))
EOF

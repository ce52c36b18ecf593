#!/bin/bash
set -e
printf '#!/bin/bash\necho "Hello, $NAME"\n' > /app/greet.sh && chmod +x /app/greet.sh

# Create directory $1 with its parents; then, if $2 is not empty, make $2 its owner.
mkdir -p -- "$1" && if [ -n "$2" ]; then chown -- "$2" "$1"; fi

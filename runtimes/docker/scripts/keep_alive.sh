# The container's command (PID 1, or docker-init's child): sleeps forever, exits at once on
# ``docker stop``, and reaps orphans when there is no init.
trap 'exit 0' TERM INT; while :; do sleep 86400 & wait $!; done

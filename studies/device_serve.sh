# Sourced by the device scripts: `serve LOG [serve flags...]` starts `rtc-agent serve` on the model $model and port
# ${PORT:-8080} in the background (its pid in $server, its log in LOG) and returns once /readyz answers; a server
# that dies while loading ends the run there, with the end of its log.
serve() {
    local log=$1; shift
    python3 -m rtc_agent.cli serve --model "$model" --port "${PORT:-8080}" --ice-host-address 127.0.0.1 "$@" \
        > "$log" 2>&1 &
    server=$!
    until python3 -c "import urllib.request, sys; urllib.request.urlopen(sys.argv[1])" \
            "http://127.0.0.1:${PORT:-8080}/readyz" 2> /dev/null; do
        kill -0 "$server" 2> /dev/null || { echo "serve exited:"; tail -40 "$log"; exit 1; }
        sleep 2
    done
}

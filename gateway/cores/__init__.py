"""Process topology, no HTTP (nothing here imports starlette): the messages between front
ends and engine cores (`wire`), the engine core (`core`) and its process (`proc`), the core
client a front end holds (`client`, with its requests in flight, `inflight`, and their text,
`text`), launching child processes (`launch`), watching and restarting cores (`process`,
`restarts`), and the `--api-workers` supervisor (`supervisor`)."""

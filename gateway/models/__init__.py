"""What a gateway serves, with no HTTP and no sockets: the kinds of model, the catalogue of
model specs (defaults, --config files, fakes), load diagnosis, starting a model in this
process, and the one face every served batcher shows (`ServedBatcher`)."""

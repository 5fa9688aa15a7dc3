"""The gateway's metrics: its registry, merging the engine cores' families into one scrape,
and the multiprocess directory several front ends share."""

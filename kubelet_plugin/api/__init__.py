"""The plugin's API server client: requests, credentials, rate limits and retries, watches
and the local copies they keep, Events on the Node. Imports no other layer of the plugin."""

"""fgrpo_app: a ServerApp of one's own (`own_server_app`) beside the packaged apps the example runs."""

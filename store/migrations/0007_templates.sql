-- Templates added with the gVisor runtime (hostd's registry in hostd/src/template.rs names the
-- same templates and runtimes): the busybox userland on runsc, whose stop keeps memory, and a
-- Debian minimal with python3 on runsc.
INSERT INTO templates (name, description, runtime)
VALUES ('base-gvisor', 'BusyBox userland on gVisor (runsc): stop keeps memory and processes', 'runsc'),
       ('python', 'Debian minimal with python3 on gVisor (runsc): stop keeps memory', 'runsc')
ON CONFLICT (name) DO NOTHING;

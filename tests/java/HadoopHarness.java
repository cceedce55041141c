// Hadoop's own client against `sos gateway`: FileSystem, FileContext and FsShell calls,
// compiled with the JDK's javac by tests/gateway/test_hadoop_tools.py (classpath: pyspark/jars).
//
//   java -cp CLASSES:JARS/* HadoopHarness URI KEY=VALUE... -- CASE...
//
// Each CASE runs against URI (webhdfs://HOST:PORT/BASE) with the settings KEY=VALUE and prints
// one line "CASE<TAB>ok<TAB>result" or "CASE<TAB>error<TAB>ExceptionClass: message". A CASE
// "shell:ARG|ARG|..." runs FsShell in this JVM (ToolRunner, as `hadoop fs` does) and prints
// "shell<TAB>EXIT<TAB>out<TAB>err" with newlines as \n; the test reads the results.

import java.io.ByteArrayOutputStream;
import java.io.EOFException;
import java.io.IOException;
import java.io.PrintStream;
import java.net.URI;
import java.nio.charset.StandardCharsets;
import java.security.MessageDigest;
import java.util.ArrayList;
import java.util.EnumSet;
import java.util.List;

import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.fs.BlockLocation;
import org.apache.hadoop.fs.ContentSummary;
import org.apache.hadoop.fs.CreateFlag;
import org.apache.hadoop.fs.FSDataInputStream;
import org.apache.hadoop.fs.FSDataOutputStream;
import org.apache.hadoop.fs.FileChecksum;
import org.apache.hadoop.fs.FileContext;
import org.apache.hadoop.fs.FileStatus;
import org.apache.hadoop.fs.FileSystem;
import org.apache.hadoop.fs.FsShell;
import org.apache.hadoop.fs.FsStatus;
import org.apache.hadoop.fs.LocatedFileStatus;
import org.apache.hadoop.fs.MD5MD5CRC32CastagnoliFileChecksum;
import org.apache.hadoop.fs.Options;
import org.apache.hadoop.fs.Path;
import org.apache.hadoop.fs.RemoteIterator;
import org.apache.hadoop.io.MD5Hash;
import org.apache.hadoop.util.DataChecksum;
import org.apache.hadoop.util.ToolRunner;

public class HadoopHarness {
    static final long BLOCK_SIZE = 128L << 20;
    static Configuration conf;
    static FileSystem fs;
    static Path base;

    public static void main(String[] args) throws Exception {
        conf = new Configuration();
        int i = 1;
        for (; i < args.length && !args[i].equals("--"); i++) {
            int eq = args[i].indexOf('=');
            conf.set(args[i].substring(0, eq), args[i].substring(eq + 1));
        }
        URI uri = new URI(args[0]);
        fs = FileSystem.get(uri, conf);
        base = new Path(uri);
        fs.mkdirs(base);
        for (i++; i < args.length; i++) {
            String name = args[i];
            if (name.startsWith("shell:")) {
                shell(name.substring("shell:".length()).split("\\|", -1));
                continue;
            }
            try {
                System.out.println(name + "\tok\t" + run(name));
            } catch (Exception e) {
                System.out.println(name + "\terror\t" + e.getClass().getName() + ": "
                                   + String.valueOf(e.getMessage()).replace("\n", " "));
            }
        }
        System.out.flush();
        System.exit(0);
    }

    static void shell(String[] argv) throws Exception {
        PrintStream out = System.out, err = System.err;
        ByteArrayOutputStream bo = new ByteArrayOutputStream(), be = new ByteArrayOutputStream();
        int code;
        try {
            System.setOut(new PrintStream(bo, true, "UTF-8"));
            System.setErr(new PrintStream(be, true, "UTF-8"));
            FsShell shell = new FsShell(new Configuration(conf));
            code = ToolRunner.run(shell, argv);
            shell.close();
        } finally {
            System.out.flush();
            System.err.flush();
            System.setOut(out);
            System.setErr(err);
        }
        out.println("shell\t" + code + "\t" + esc(bo.toString("UTF-8")) + "\t" + esc(be.toString("UTF-8")));
    }

    static String esc(String s) {
        return s.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n");
    }

    static Path p(String rel) {
        return new Path(base, rel);
    }

    static byte[] bytes(int n, int seed) {
        byte[] b = new byte[n];
        for (int k = 0; k < n; k++) {
            b[k] = (byte) (k * 31 + seed + (k >> 9));
        }
        return b;
    }

    static void write(Path path, byte[] data) throws IOException {
        try (FSDataOutputStream out = fs.create(path, true)) {
            out.write(data);
        }
    }

    static String read(Path path) throws IOException {
        FileStatus st = fs.getFileStatus(path);
        byte[] b = new byte[(int) st.getLen()];
        try (FSDataInputStream in = fs.open(path)) {
            in.readFully(0, b);
        }
        return new String(b, StandardCharsets.UTF_8);
    }

    static String locations(BlockLocation[] locs) throws IOException {
        StringBuilder s = new StringBuilder();
        for (BlockLocation l : locs) {
            s.append(l.getOffset()).append('+').append(l.getLength()).append('@')
             .append(String.join(",", l.getHosts())).append('/')
             .append(String.join(",", l.getNames())).append(';');
        }
        return s.toString();
    }

    /** HDFS's MD5-of-MD5-of-CRC32C of data, computed here with Hadoop's own DataChecksum and
     *  MD5Hash (what a DataNode and DFSClient do), independently of the gateway. */
    static FileChecksum expectedChecksum(byte[] data) throws Exception {
        DataChecksum sum = DataChecksum.newDataChecksum(DataChecksum.Type.CRC32C, 512);
        ByteArrayOutputStream md5s = new ByteArrayOutputStream();
        int blocks = 0;
        for (long start = 0; start < data.length; start += BLOCK_SIZE) {
            int len = (int) Math.min(BLOCK_SIZE, data.length - start);
            int chunks = (len + 511) / 512;
            byte[] crcs = new byte[chunks * 4];
            sum.calculateChunkedSums(data, (int) start, len, crcs, 0);
            md5s.write(MessageDigest.getInstance("MD5").digest(crcs));
            blocks++;
        }
        long crcPerBlock = blocks > 1 ? BLOCK_SIZE / 512 : 0;
        return new MD5MD5CRC32CastagnoliFileChecksum(512, crcPerBlock, MD5Hash.digest(md5s.toByteArray()));
    }

    static String run(String name) throws Exception {
        switch (name) {
            case "blocklocations": {
                Path d = p("blocks");
                fs.mkdirs(d);
                write(new Path(d, "a"), bytes(3000, 1));
                write(new Path(d, "empty"), new byte[0]);
                FileStatus st = fs.getFileStatus(new Path(d, "a"));
                String whole = locations(fs.getFileBlockLocations(st, 0, st.getLen()));
                String past = locations(fs.getFileBlockLocations(st, 5000, 10));
                String empty = locations(fs.getFileBlockLocations(new Path(d, "empty"), 0, 10));
                List<String> listed = new ArrayList<>();
                RemoteIterator<LocatedFileStatus> it = fs.listFiles(d, true);
                while (it.hasNext()) {
                    LocatedFileStatus l = it.next();
                    listed.add(l.getPath().getName() + "=" + locations(l.getBlockLocations()));
                }
                RemoteIterator<LocatedFileStatus> it2 = fs.listLocatedStatus(d);
                int located = 0;
                while (it2.hasNext()) {
                    it2.next();
                    located++;
                }
                return "whole=" + whole + " past=" + past + " empty=" + empty + " listFiles="
                       + String.join(" ", listed) + " listLocatedStatus=" + located;
            }
            case "blocklocations-dir": {
                fs.mkdirs(p("blocks-dir"));
                return locations(fs.getFileBlockLocations(p("blocks-dir"), 0, 1));
            }
            case "createNonRecursive": {
                Path f = p("cnr");
                write(f, "old".getBytes(StandardCharsets.UTF_8));
                try (FSDataOutputStream out = fs.createNonRecursive(f, true, 4096, (short) 1, BLOCK_SIZE, null)) {
                    out.write("new".getBytes(StandardCharsets.UTF_8));
                }
                String after = read(f);
                String missingParent;
                try {
                    fs.createNonRecursive(p("cnr-missing/f"), true, 4096, (short) 1, BLOCK_SIZE, null).close();
                    missingParent = "created";
                } catch (IOException e) {
                    missingParent = e.getClass().getSimpleName();
                }
                String noOverwrite;
                try {
                    fs.createNonRecursive(f, false, 4096, (short) 1, BLOCK_SIZE, null).close();
                    noOverwrite = "created";
                } catch (IOException e) {
                    noOverwrite = e.getClass().getSimpleName();
                }
                return after + " " + missingParent + " " + noOverwrite;
            }
            case "createFileBuilder": {
                Path f = p("builder");
                write(f, "old".getBytes(StandardCharsets.UTF_8));
                try (FSDataOutputStream out = fs.createFile(f).overwrite(true).build()) {
                    out.write("built".getBytes(StandardCharsets.UTF_8));
                }
                String first = read(f);
                FileContext fc = FileContext.getFileContext(base.toUri(), conf);
                try (FSDataOutputStream out = fc.create(f, EnumSet.of(CreateFlag.CREATE, CreateFlag.OVERWRITE))) {
                    out.write("context".getBytes(StandardCharsets.UTF_8));
                }
                String second = read(f);
                try (FSDataOutputStream out = fc.create(f, EnumSet.of(CreateFlag.CREATE, CreateFlag.APPEND))) {
                    out.write("+more".getBytes(StandardCharsets.UTF_8));
                }
                return first + " " + second + " " + read(f);
            }
            case "checksum": {
                byte[] data = bytes(5 * 512 + 77, 7);
                Path f = p("sum");
                write(f, data);
                FileChecksum got = fs.getFileChecksum(f);
                FileChecksum want = expectedChecksum(data);
                write(p("sum-empty"), new byte[0]);
                FileChecksum empty = fs.getFileChecksum(p("sum-empty"));
                return got.getAlgorithmName() + " " + (got.equals(want) ? "true" : got + "!=" + want) + " " + got.getLength()
                       + " empty=" + empty;
            }
            case "checksum-2blocks": {
                // a block and a bit: crcPerBlock is the first block's CRC count (262144)
                byte[] data = bytes((int) BLOCK_SIZE + 1000, 3);
                Path f = p("sum2");
                write(f, data);
                FileChecksum got = fs.getFileChecksum(f);
                FileChecksum want = expectedChecksum(data);
                return got.getAlgorithmName() + " " + (got.equals(want) ? "true" : got + "!=" + want);
            }
            case "checksum-dir": {
                fs.mkdirs(p("sum-dir"));
                return String.valueOf(fs.getFileChecksum(p("sum-dir")));
            }
            case "seekPastEnd": {
                Path f = p("short");
                write(f, "12345".getBytes(StandardCharsets.UTF_8));
                try (FSDataInputStream in = fs.open(f)) {
                    byte[] b = new byte[4];
                    try {
                        in.readFully(10, b);
                        return "read";
                    } catch (EOFException e) {
                        return "EOFException";
                    }
                }
            }
            case "renameIntoChild": {
                fs.mkdirs(p("rdir/sub"));
                boolean old = fs.rename(p("rdir"), p("rdir/sub/in"));
                String rename2;
                try {
                    FileContext.getFileContext(base.toUri(), conf)
                        .rename(p("rdir"), p("rdir/sub/in2"), Options.Rename.NONE);
                    rename2 = "renamed";
                } catch (IOException e) {
                    rename2 = e.getClass().getSimpleName();
                }
                return old + " " + rename2 + " " + fs.exists(p("rdir/sub"));
            }
            case "deleteRoot": {
                return String.valueOf(fs.delete(new Path(base, "/"), true)) + " "
                       + fs.exists(base);
            }
            case "status": {
                FsStatus s = fs.getStatus();
                return (s.getCapacity() > 0) + " " + (s.getRemaining() > 0) + " "
                       + (s.getUsed() >= 0) + " " + (s.getCapacity() >= s.getRemaining());
            }
            case "setOwner": {
                Path f = p("owned");
                write(f, new byte[1]);
                FileStatus before = fs.getFileStatus(f);
                fs.setOwner(f, "alice", "staff");
                FileStatus st = fs.getFileStatus(f);
                return before.getOwner().equals(st.getOwner()) + " "
                       + before.getGroup().equals(st.getGroup()) + " " + st.getOwner().equals("alice");
            }
            case "contentSummary": {
                fs.mkdirs(p("cs"));
                write(p("cs/f"), new byte[10]);
                ContentSummary dir = fs.getContentSummary(p("cs"));
                ContentSummary file = fs.getContentSummary(p("cs/f"));
                return "[" + dir.getErasureCodingPolicy() + "] [" + file.getErasureCodingPolicy() + "] "
                       + dir.getLength() + " " + dir.getFileCount();
            }
            case "trashRoot": {
                return fs.getTrashRoot(p("x")).toUri().getPath() + " "
                       + fs.getTrashRoots(true).size();
            }
            default:
                throw new IllegalArgumentException("no such case: " + name);
        }
    }
}
